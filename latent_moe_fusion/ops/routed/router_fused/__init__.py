"""The ops that put the router in front of the routed experts: lmf::route_and_project (router + latent down-projection
side by side), lmf::route_and_produce (that and lmf::moe_shared_producer as one op), lmf::route_gather_and_produce
(route_and_produce for the SP block, gathering its tokens beside the router), and the down-projection."""
