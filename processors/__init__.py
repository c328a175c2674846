"""Stream processors: the Faust projector, the Redis projection store, replay and decisions."""
