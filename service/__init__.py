"""Starting the service's processes (Redis, scheduler, gateway, workers) and supervising them."""
