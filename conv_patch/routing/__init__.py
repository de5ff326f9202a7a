"""Which route a call takes: the route registry, the config tables, the cost
model and the one decision."""
