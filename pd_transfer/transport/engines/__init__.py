"""The optional engine transports, Mooncake and NIXL, and what they share.

``registry`` builds either by name; ``link`` and ``address`` are what both
engines' links and published addresses have in common; ``runs`` shapes a plan
into absolute, batched runs; ``strategy`` and ``probe`` choose direct writes
or ``staging/`` per peer pair and pool.
"""
