"""The rank runtime: forking local ranks, stop signals, preemption and requeue inside a job."""
