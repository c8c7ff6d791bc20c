"""GPU check: run the CUDA path on one GPU and report whatever happens, as one JSON object.

Stages, smallest first; each writes its result into the JSON file before the next starts, runs
under its own try/except (a failure is recorded, the rest still runs), after the stages it
needs, and only when the time budget left covers its estimate (else it is skipped, saying so):

0. ``wheels``: the wheels of ``--wheel-dir`` installed into ``--wheel-site``, each expected one
   reported ``installed``, ``missing`` or ``failed`` (the stage fails unless all installed);
1. first contact (well under 90 s): ``device`` (the machine and its GPU), ``layer_check`` (one
   decoder layer forward/backward on the GPU against autograd), ``tiny_steps`` (two training
   steps of a small model through every tier: device, host, NVMe, recompute, kept internals),
   ``nvme_state`` (three steps with the store's state, weights and gradients in files on the
   disk of ``--out``, against the same steps in RAM: equal to the bit), ``pinned_arena`` (the
   store's arena registered in place), ``copy_bandwidth`` (H2D/D2H);
2. ``cuda_tests``: pytest over only the test files that hold ``cuda``-marked tests;
3. the large model: ``model`` (sized to ``--host-budget-gb``), ``calibration``, ``optimizer``,
   ``planner``, ``plan:lora`` (one layer of the model's widths, NF4 frozen base, LoRA
   adapters), ``store`` (4.5B parameters by default), ``plan:<name>`` (the planner's first,
   then the rules, largest predicted device peak last), ``simulator``.

Device memory: the check's process runs with ``PYTORCH_CUDA_ALLOC_CONF`` holding
``expandable_segments:True`` (added before torch starts CUDA), the model is sized so every
plan's predicted peak fits the GPU less ``DEVICE_MARGIN_BYTES``, and each engine is capped there.

The host RAM is given (``--host-budget-gb``), never read from MemTotal/MemAvailable, which on
some GPU machines start far below their RAM and grow as memory is used. ``--dry-run`` runs
every stage's Python on the CPU (a tiny model, the engine's asynchronous CPU backend), all but
the CUDA calls; the test suite runs it so the check cannot rot. The JSON schema is defined once
(``schema.py``) and printed as markdown tables by ``--print-schema``.

Modules, each importing only those above it: ``report`` (the stage runner and the JSON file),
``schema``, ``machine`` (``Dev``: CUDA or the dry run's CPU backend; the machine's facts),
``trace`` (a profiled step's copies against its kernels), ``wheels``, ``cuda_tests``, ``first``
(first contact), ``nvme_state`` (the state on the disk against RAM), ``model`` (the large model
and the plans it runs), ``probes`` (calibration, optimizer, planner), ``store``, ``plans`` (steps
per plan, the simulator), ``lora``, ``cli``.

From the repository root, with ``src`` on ``PYTHONPATH``:

    python -m benchmarks.gpu_check --host-budget-gb 137.4 [--out gpu-check.json] [--budget-s 360]
    python -m benchmarks.gpu_check --dry-run
    python -m benchmarks.gpu_check --host-budget-gb 137.4 --wheel-dir .whl --wheels highspy,blake3
    make gpu-check                  # wheels from .whl/, the Makefile's host RAM and time budget

Exit status: 0 when every stage is ok (and without a GPU, where it only says so), else 1.
The package imports only the standard library at load time; each stage imports what it uses.
"""
