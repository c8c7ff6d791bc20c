"""The planner: from a model's shape and a hardware profile to a ``Plan`` the engine obeys.

The contract it writes lives in ``layerwise.plan``; this package decides it. ``run_plan`` is the
entry ``layerwise train plan=auto`` imports by name; ``cli`` is ``layerwise plan`` and
``calibrate_cli`` ``layerwise calibrate``. Inside: the hardware profiles (``hardware``,
``presets``, ``hardware_choice``, ``machine``, ``calibrate``), the cost model (``cost`` over the
kernel roofline of ``device_cost``, ``step_model``), the MILP (``formulation`` over named
``columns``, solved by ``milp``), the outer ``search``, the discrete-event ``simulator`` and its
``trace``, the ``check``er and ``timeline`` drawing, and the data-parallel ``topology`` and
``scaling`` prediction. Nothing here is imported at package import: ``layerwise plan --help``
stays torch-free.
"""
