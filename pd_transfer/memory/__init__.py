"""Memory shared between processes: shared-memory segments, the SIGBUS guard, orphan cleanup, CUDA IPC handles, doorbells."""
