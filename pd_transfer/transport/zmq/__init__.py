"""The tcp data plane over ZeroMQ sockets: the variant with CURVE encryption.

Same frames and the same room rules as :mod:`pd_transfer.transport.tcp`;
``transport`` sends on a DEALER, ``receiver`` serves a ROUTER.
"""
