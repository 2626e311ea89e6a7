# Writes tests/trees/data/trees_v1.zarr with the schema-1 code of main (run with PYTHONPATH=/work/main).
import sys
import numpy as np
from gyre_hpc.trees.builder import build_tree
from gyre_hpc.trees.model import ModelCall
from gyre_hpc.trees.store import TreeStore, StoreLayout
from gyre_hpc.trees.store_schema import SCHEMA_VERSION
assert SCHEMA_VERSION == 1
BOS = 257
j1 = [ModelCall([BOS, 1, 2], [3, 4], [-0.5, -0.25]), ModelCall([BOS, 1, 2], [3, 4], [-0.75, -0.125])]
j2 = [ModelCall([BOS, 5], [6, 7, 8], [-1.0, -2.0, -0.5]), ModelCall([BOS, 5, 6, 7, 8, 9], [], []),
      ModelCall([BOS, 5, 6], [7, 1], [-1.5, -0.0625], role="subagent", agent="s0")]
with TreeStore.open(sys.argv[1], "a", layout=StoreLayout(token_chunk=8, node_chunk=4, call_chunk=4, dropped_chunk=4, tree_chunk=4), durable=False) as s:
    s.append([build_tree(j1, run_id="a", task_id="t", reward=1.0), build_tree(j2, run_id="b", task_id="t", reward=0.0, status="timeout")])
