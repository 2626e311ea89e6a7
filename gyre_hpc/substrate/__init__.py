"""The substrate (smoke) workload: the fleet's flips, checkpoints and faults on an MLP with ballast, no models or trees."""
