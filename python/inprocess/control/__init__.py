"""The restart control plane: the store protocol of a restart (events, seats,
barriers, decisions), the membership table, the torch-free TCPStore client and
a rank's link to its node agent. Imports no torch: the helper processes use it.
"""
