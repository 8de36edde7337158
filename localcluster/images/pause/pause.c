/*
 * pause — the sandbox ("infra") container of a local-cluster pod.
 *
 * It holds the pod's namespaces open and does nothing else: it sleeps, reaps any
 * child that ends up re-parented to it (it is PID 1 of the pod when the pod shares
 * its PID namespace), and exits 0 on SIGINT or SIGTERM. Same contract as the
 * upstream registry.k8s.io/pause binary; built with `gcc -static` by
 * localcluster/build-images.sh and packed into an image FROM scratch.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef PAUSE_VERSION
#define PAUSE_VERSION "rljob-local"
#endif

static void on_term(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  int saved = errno;
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

int main(int argc, char **argv) {
  if (argc > 1 && (strcmp(argv[1], "-v") == 0 || strcmp(argv[1], "--version") == 0)) {
    printf("pause %s\n", PAUSE_VERSION);
    return 0;
  }
  if (getpid() != 1) {
    fprintf(stderr, "pause: warning: not PID 1, so orphaned children are not reaped here\n");
  }

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sigemptyset(&sa.sa_mask);
  sa.sa_handler = on_term;
  if (sigaction(SIGINT, &sa, NULL) < 0 || sigaction(SIGTERM, &sa, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }
  sa.sa_handler = on_child;
  sa.sa_flags = SA_NOCLDSTOP | SA_RESTART;
  if (sigaction(SIGCHLD, &sa, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }

  for (;;) {
    pause();
  }
}
