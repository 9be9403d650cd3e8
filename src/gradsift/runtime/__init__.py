"""What every runtime shares, and the simulator: one rank (``rank``: compressor, route owner, road, hand-offs,
checks, state), its settings (``settings``), what ranks agree on (``consensus``), one description of a training
run (``runconfig``), FSDP's gradient layout (``sharding``) and the in-process simulator of N ranks (``simulate``).
The ``torch.distributed`` runtimes built on it are :mod:`gradsift.ddp` and :mod:`gradsift.fsdp`."""
