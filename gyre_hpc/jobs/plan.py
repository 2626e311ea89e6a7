"""Where each part of the fleet runs: the controller rank and every cell, as launch components.

The MPI world layout is the fleet contract: world rank 0 is the controller, cell ``c`` owns
ranks ``1 + c*rpc .. 1 + (c+1)*rpc - 1``. MPI numbers ranks in component order (MPMD order
under mpiexec, het-group order under srun), so listing the components controller first, then
cell 0, 1, ... is what produces that layout on every launcher.

Pure functions of the config and the allocation (node names, het-group env), so the plans
are tested without Slurm; the launchers turn a plan into a command line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from gyre_hpc.config import ConfigError, RunConfig


@dataclass(frozen=True)
class Component:
    """One MPMD block of the fleet: the controller or one cell."""

    name: str                    # "controller" or "cell<c>"
    ntasks: int
    nodes: tuple[str, ...] = ()  # () = wherever the launcher puts it (local, or srun's own choice)
    cpus_per_task: int = 1
    nnodes: int = 1              # node count when ``nodes`` is empty
    # Memory a node gives this block (srun --mem); 0 = Slurm's default, which is the whole
    # node where no DefMemPerNode is set, so then one block takes a node.
    mem_mb: int = 0
    het_group: int | None = None  # set when the component is a het group of the surrounding job


@dataclass(frozen=True)
class FleetPlan:
    components: tuple[Component, ...]

    @property
    def world_size(self) -> int:
        return sum(c.ntasks for c in self.components)

    @property
    def het_groups(self) -> tuple[int, ...] | None:
        """The job's het groups when the plan fills a het job (``srun --het-group``); else None."""
        groups = [c.het_group for c in self.components]
        if all(g is not None for g in groups):
            return tuple(groups)  # type: ignore[arg-type]
        return None

    @property
    def packed(self) -> bool:
        """Blocks that may share nodes: placed by Slurm (no node lists, one node each), all of
        one shape, each with its memory named (a block without it takes a whole node)."""
        comps = self.components
        return (all(not c.nodes and c.het_group is None and c.nnodes == 1 and c.mem_mb for c in comps)
                and len({(c.cpus_per_task, c.mem_mb) for c in comps}) == 1)

    def ranks_of(self, name: str) -> range:
        first = 0
        for c in self.components:
            if c.name == name:
                return range(first, first + c.ntasks)
            first += c.ntasks
        raise KeyError(f"no component {name!r}; components are {[c.name for c in self.components]}")


def _cell_components(cfg: RunConfig, nodes_of_cell) -> list[Component]:
    return [Component(name=f"cell{c}", ntasks=cfg.cells.ranks_per_cell, nodes=nodes_of_cell(c),
                      cpus_per_task=cfg.cells.cpus_per_rank, nnodes=cfg.cells.nodes_per_cell,
                      mem_mb=cfg.cells.mem_per_cell_mb)
            for c in range(cfg.cells.count)]


def local_plan(cfg: RunConfig) -> FleetPlan:
    """No placement: every rank on this machine under ``mpiexec``, or where ``srun`` puts it."""
    head = Component(name="controller", ntasks=1, cpus_per_task=1, mem_mb=cfg.cells.mem_per_cell_mb)
    return FleetPlan((head, *_cell_components(cfg, lambda c: ())))


def cpus_per_node(value: str | None) -> int | None:
    """The fewest CPUs of any node in ``SLURM_JOB_CPUS_PER_NODE`` ("4(x3),2" -> 2); None when unset."""
    if not value:
        return None
    try:
        return min(int(part.split("(")[0]) for part in value.split(","))
    except ValueError:
        raise ConfigError(f"SLURM_JOB_CPUS_PER_NODE={value!r} is not Slurm's 'N(xM),N' form") from None


def check_ranks_fit_nodes(cfg: RunConfig, node_cpus: int) -> None:
    """ConfigError naming the fields when a cell's ranks need more CPUs than its nodes have:
    srun spreads a cell's ``ranks_per_cell`` tasks over its ``nodes_per_cell`` nodes, so the
    fullest node runs ceil(ranks / nodes) of them at ``cpus_per_rank`` each."""
    c = cfg.cells
    per_node = -(-c.ranks_per_cell // c.nodes_per_cell)
    if per_node * c.cpus_per_rank > node_cpus:
        raise ConfigError(
            f"cells.ranks_per_cell={c.ranks_per_cell} over cells.nodes_per_cell={c.nodes_per_cell} puts {per_node} "
            f"rank(s) x cells.cpus_per_rank={c.cpus_per_rank} = {per_node * c.cpus_per_rank} CPUs on a node, "
            f"the allocation's nodes have {node_cpus}")


def plan_for_nodes(cfg: RunConfig, nodes: list[str], node_cpus: int | None = None) -> FleetPlan:
    """A het *step* inside a plain allocation (submitit): cells get whole nodes, in order.

    With a spare node the controller gets nodes[0] to itself; otherwise it shares the first
    cell's node (it is one light rank). Too few nodes for the cells, or a cell's ranks more
    than its nodes' CPUs (``node_cpus``, the allocation's smallest node, when known), fails
    naming the fields.
    """
    cfg.validate_against_nodes(len(nodes))
    if node_cpus is not None:
        check_ranks_fit_nodes(cfg, node_cpus)
    npc = cfg.cells.nodes_per_cell
    need = cfg.cells.count * npc
    cell_nodes = nodes[1:1 + need] if len(nodes) > need else nodes[:need]
    head = Component(name="controller", ntasks=1, nodes=(nodes[0],), cpus_per_task=1, mem_mb=cfg.cells.mem_per_cell_mb)
    cells = _cell_components(cfg, lambda c: tuple(cell_nodes[c * npc:(c + 1) * npc]))
    return FleetPlan((head, *cells))


def het_job_shape(cfg: RunConfig) -> list[tuple[int, int, int]]:
    """(nodes, ntasks, cpus_per_task) of each het component the sbatch script must request."""
    rpc = cfg.cells.ranks_per_cell
    return [(1, 1, cfg.slurm.head_cpus)] + [
        (cfg.cells.nodes_per_cell, rpc, cfg.cells.cpus_per_rank)] * cfg.cells.count


def plan_for_het_job(cfg: RunConfig, env: Mapping[str, str], expand=lambda s: [s]) -> FleetPlan:
    """The het job's own components: group 0 = head + controller, group 1+c = cell c.

    The job's shape is fixed at submission (#SBATCH lines), the config may have changed since;
    a mismatch is reported with both shapes instead of an MPI world of the wrong size.
    """
    size = int(env["SLURM_HET_SIZE"])
    want = het_job_shape(cfg)
    if size != len(want):
        raise ConfigError(
            f"the het job has {size} components, cells.count={cfg.cells.count} needs {len(want)} "
            f"(1 head + 1 per cell); regenerate the script with `gyre-hpc submit --sbatch CONFIG`")
    comps = []
    for g, (nnodes, ntasks, cpus) in enumerate(want):
        got = int(env.get(f"SLURM_NTASKS_HET_GROUP_{g}", ntasks))
        if got != ntasks:
            field = "the head" if g == 0 else f"cell {g - 1} (cells.ranks_per_cell)"
            raise ConfigError(f"het group {g} has {got} tasks, {field} needs {ntasks}; "
                              f"regenerate the script with `gyre-hpc submit --sbatch CONFIG`")
        nodes = tuple(expand(env[f"SLURM_JOB_NODELIST_HET_GROUP_{g}"]))
        name = "controller" if g == 0 else f"cell{g - 1}"
        comps.append(Component(name=name, ntasks=ntasks, nodes=nodes, cpus_per_task=cpus, nnodes=len(nodes),
                               het_group=g))
    return FleetPlan(tuple(comps))
