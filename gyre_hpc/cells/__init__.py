"""The fleet: controller, cells, roles, communicators, engines' and trainers' processes."""
