"""Ray pools and actors, weight-sync transports and the sync/async schedulers."""
