"""dist_kernel: a Jupyter kernel that runs every cell on N torch.distributed ranks."""

__version__ = "0.1.0"
