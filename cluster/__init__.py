"""Ray bootstrap, placement groups and the torch.distributed rendezvous of a TP group."""
