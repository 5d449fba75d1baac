"""Tensor parallelism: the meta device (:mod:`.meta`: split states, per-op plans), the SDK's
all-reduce algorithms (:mod:`.comm`) and process groups over MPI (:mod:`.mpi`)."""
