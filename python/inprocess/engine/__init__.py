"""The rank's restart engine, below :mod:`inprocess.wrap`: interrupting the
main thread, the restart trigger, the process groups and sockets a call
created, and the validated configuration. Runs inside the training process.
"""
