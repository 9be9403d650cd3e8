"""What every runtime shares, and the simulator: one rank (``rank``: compressor, route owner, road, hand-offs,
checks, state), the road a group of gradients travels (``road``), parameters a step did not use (``unused``),
telemetry (``telemetry``) and the files it is written to (``records``), resuming at another world size
(``elastic``), its settings (``settings``), what ranks agree on (``consensus``), one description of a training
run (``runconfig``), FSDP's gradient layout (``sharding``) and the in-process simulator of N ranks (``simulate``).
The ``torch.distributed`` runtimes built on it are :mod:`gradsift.ddp` and :mod:`gradsift.fsdp`."""
