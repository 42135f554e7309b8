// LD_PRELOAD helper for scripts/probe/gpu_probe.sh: on SIGSEGV/SIGBUS/SIGFPE/SIGABRT, print the fault
// address and a native backtrace (module+offset, for addr2line) to stderr, then die with the signal.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_signal(int sig, siginfo_t* si, void* ctx) {
  (void)ctx;
  char msg[160];
  int n = snprintf(msg, sizeof msg, "\n=== native backtrace: signal %d, fault address %p\n", sig, si->si_addr);
  write(2, msg, n);
  void* frames[96];
  int count = backtrace(frames, 96);
  backtrace_symbols_fd(frames, count, 2);
  write(2, "=== end of backtrace\n", 21);
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO;
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
}
