"""The job's control plane: a coordinator one agent hosts and every agent of the job talks to over TCP.

It carries what must be decided together and quickly (the restart notice, the restart barrier, lost nodes,
the hand-over to the next job of a chain) without polling the shared file system; the run folder keeps the
durable records, written once at each event. Standard library only: agents and login nodes never import torch.
"""
