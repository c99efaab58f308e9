"""`kvmesh plan`: from N agents and service levels to the cheapest fleet that meets them.

Candidate fleets (layout, size, aggregated or P/D, routing preset, host tier, MTP) are
enumerated (plan.candidates), the ones the analytic cost model shows cannot meet the targets or
the budget are pruned (plan.capacity), and the rest are run through the fleet simulator in
parallel processes, cheapest first (plan.search); plan.results judges them against the targets
and plan.outputs writes the JSON, the plot and a Helm values file for deploy/helm/kvmesh.
"""
