"""The restart control plane: the store protocol of a restart (events, seats,
barriers, decisions), the membership table, the torch-free TCPStore client,
a rank's link to its node agent, and the launcher's incarnation that scopes every
key. Imports no torch: the helper processes use it.
"""
