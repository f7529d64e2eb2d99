"""Planning a run before it starts: ``python -m gem.plan <overrides> plan.world_size=1024 ...``.

On a CPU, without a process group or GPUs, for the configured model, tables, batch and layout:

- where every table shard goes (TorchRec's planner for a ``Topology`` of ``plan.world_size`` ranks,
  on a meta-device SparseArch), saved to a file that ``sparse.plan_file=<path>`` makes a real
  run use (gem/plan/planner.py);
- the memory of every rank: table weights and their optimizer state, the dense parameters,
  gradients and AdamW state under the ``parallelism.*`` layout, the gathered FSDP blocks, and the
  activations a probe forward measures, with a warning and a fix where a rank goes over budget;
- a step-time model (gem/plan/steptime.py): embedding traffic, all-to-all over NVLink and the
  network, dense compute at a given MFU, FSDP collectives, for 1 .. 4096 GPUs.

See docs/planning.md.
"""
