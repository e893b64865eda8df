"""What runs on each machine of a multi-node kernel: the node agent (see agent.py)."""
