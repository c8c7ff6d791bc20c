"""The planner: from a model's shape and a hardware profile to a ``Plan`` the engine obeys.

The contract lives in ``layerwise.plan``; this package decides it (``docs/planner.md``). Nothing
is imported at package import, so ``layerwise plan --help`` stays torch-free."""
