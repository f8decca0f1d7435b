"""Configuration search: space, cost model, node/edge elimination, baseline strategies."""

from taskrt.search.baselines import BASELINES, data_parallel, model_parallel, owt
from taskrt.search.budget import MemoryBudgetError, parse_memory
from taskrt.search.cost import Breakdown, CostModel
from taskrt.search.dfs import depth_first
from taskrt.search.eliminate import minimize
from taskrt.search.families import FamilyError, integrated, integrated_family, splitbrain, splitbrain_family
from taskrt.search.optimize import SearchAgain, optimize
from taskrt.search.space import layer_configs, search_space

__all__ = [
    "BASELINES", "Breakdown", "CostModel", "FamilyError", "data_parallel", "depth_first", "integrated",
    "integrated_family", "layer_configs", "MemoryBudgetError", "minimize", "model_parallel", "optimize", "owt",
    "parse_memory", "SearchAgain", "search_space", "splitbrain", "splitbrain_family",
]
