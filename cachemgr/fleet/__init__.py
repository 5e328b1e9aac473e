"""The fleet tier: one index for many hosts (PostgreSQL through cachemgr.index) and the shared
artifact tier PyTorch itself reads (its Redis remote cache, cachemgr.fleet.remote).

Nothing here imports torch: the layout of the remote cache is read off torch's source
(torch/_inductor/remote_cache.py, codecache.py, _functorch/_aot_autograd/autograd_cache.py).
"""
