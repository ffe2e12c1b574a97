"""Triton backend of lmf::noaux_tc_route (route_topk.py)."""
