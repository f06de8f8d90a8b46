/* Preloaded into every process of the test suite (scripts/test.sh): sched_yield(2) sleeps.
 *
 * A rank waiting in a blocking MPI call spins in Open MPI's progress loop, and with
 * mpi_yield_when_idle (set when ranks outnumber cores) each turn of the loop calls
 * sched_yield().  On this suite's machines, up to 8 ranks on 2 cores, that spinning took about
 * a seventh of the suite's CPU (perf), time the ranks being waited for could not have: under
 * CFS a yielding task stays runnable and is soon picked again.  Sleeping instead takes the
 * waiting rank off the core; the wait then ends up to about one sleep late, which no test's
 * result depends on.  Only the suite preloads it: psrt's jobs keep the MPI library's behaviour. */
#define _GNU_SOURCE
#include <sched.h>
#include <time.h>

int sched_yield(void)
{
    /* 50 us: long enough to free the core, short against any message a test times. */
    struct timespec pause = {0, 50 * 1000};
    nanosleep(&pause, NULL);
    return 0;
}
