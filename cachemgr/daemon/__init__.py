"""The cachemgr daemon: it wires the watcher, the scheduler, metrics and systemd notification.

Index logic lives in cachemgr.index (live.py applies watched batches), eviction in cachemgr.evict.
"""
