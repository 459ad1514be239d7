"""Developer tools, one command each (``python -m tools.<name> --help``):

    fa2_configs   time every candidate tile config of each FA2 kernel on its own (the autotune lists in kernels/fa2.py)
    fa3_variants  check and time variants of the Gluon FA3 forward or backward side by side
    fa3_cubins    build the FA3 kernels' cubins with any Triton release (CPU), time them against the native ones (GPU)
    cross_entropy_configs  time the cross-entropy kernel's configs against inductor's (kernels.cross_entropy.CONFIG)
    profile_step  where a training step's time goes: the trainer's and the bare loop's steps under torch.profiler

User benchmarks are in bench/.
"""
