"""The ops that put the router in front of the routed experts: lmf::route_and_project (router + latent down-projection
side by side) and lmf::route_and_produce (that and lmf::moe_shared_producer as one op), and the down-projection."""
