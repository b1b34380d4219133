"""What every backend shares: the node script and env, workdir rules, the node-pool fit rule
and the task features a backend may declare it does not support."""
