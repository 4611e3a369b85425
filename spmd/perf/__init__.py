"""What a domain-parallel step costs per rank, measured here and predicted for thousands
of ranks: ``estimate`` measures one step (collectives, bytes, saved memory, compute of
one rank's shard), ``Estimate.predict`` carries it to a larger mesh with a ``Network``
(latency and bandwidth: nominal presets in ``NETWORKS``, or ``fit_network`` from timed
collectives), ``format_predictions`` prints a sweep.

    est = spmd.estimate(model, mesh, P(None, None, "sp"), x)
    print(est)
    for p in est.sweep([8, 64, 512, 4096], network=spmd.perf.NETWORKS["ib_ndr"]):
        print(p)

``plan`` chooses the decomposition: every mesh shape and split for a rank count, each
run and priced, ranked by step time, memory or bytes.

``benchmarks/scaling.py`` plots predicted efficiency and checks predictions against
step times measured on gloo processes.
"""
from ._measure import Collective
from .cost import Estimate, estimate
from .model import Prediction, format_predictions, mesh_shape_for, predict
from .network import KINDS, NETWORKS, Network, collective_time, fit_network
from .planner import Candidate, Plan, plan

__all__ = ["estimate", "Estimate", "Collective", "Prediction", "predict", "format_predictions",
           "mesh_shape_for", "Network", "NETWORKS", "KINDS", "collective_time", "fit_network",
           "plan", "Plan", "Candidate"]
