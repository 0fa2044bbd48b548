// The `mpi` backend's extras beyond communicator.h (mpi_world() and running_under_mpi()
// are declared there): ending a whole job from an error path, the thread level granted.
#pragma once

namespace tessera::comm {

// Ends every process of the MPI job with `exit_code` (MPI_Abort). For error paths where
// peers may be blocked in a collective this rank will never join: returning from main
// would hang in MPI_Finalize. Outside mpirun (or before MPI is initialised) it exits.
[[noreturn]] void mpi_abort(int exit_code);

// True when MPI granted MPI_THREAD_MULTIPLE; otherwise every MPI call of this process is
// serialised behind one mutex (docs/comm.md, "MPI backend"). Initialises MPI.
bool mpi_thread_multiple();

}  // namespace tessera::comm
