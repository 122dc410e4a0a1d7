"""Metrics: the public serving metrics, a replica's operator metrics, and stats summed over replicas."""
