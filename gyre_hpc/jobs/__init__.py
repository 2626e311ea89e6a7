"""The head job: launchers (local mpiexec, Slurm), the supervisor, the local Slurm cluster."""
