"""What every rule works on: the GPU class catalog, the cluster as observed, the tables and
their rows, the state view and its changes, the decision a rule builds and the judgement of
its input. Imports handlers.contracts only.
"""
