/* The pod sandbox's process for the cluster kit (tests/cluster/images.py): there is no registry to pull
 * registry.k8s.io/pause from, so the kit builds this one statically and imports it into containerd.
 * It sleeps until told to stop, and reaps the zombies of the pod's PID namespace when it is their init. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) {
    (void)signo;
    _exit(0);
}

static void reap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    signal(SIGINT, stop);
    signal(SIGTERM, stop);
    signal(SIGCHLD, reap);
    for (;;) {
        pause();
    }
    return 0;
}
