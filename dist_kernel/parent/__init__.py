"""What runs in the parent kernel process: Jupyter handlers, merging, supervision of the ranks.

Nothing here imports torch.
"""
