"""What runs inside each rank process: the rank kernel, rendezvous, the fastai integration."""
