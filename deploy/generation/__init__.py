"""The request path on a replica: check a job, run its choices on the ranks, drain their output."""
