"""The rules, one concern a module: what a GPU does to a VM, new VMs, pending restarts, drains,
capacity and availability, maintenance plans, enforcement, admission, who asks, the applier's
policy, its judgment of a command and its results.
Each reads the state and returns a decision (handlers.core); none knows the engine.
"""
