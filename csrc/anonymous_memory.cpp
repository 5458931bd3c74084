#include "anonymous_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "clock.hpp"

namespace inprocess {

int create_anonymous_fd(const char* memfd_name, const std::string& shm_prefix, std::string& tried) {
#ifdef SYS_memfd_create
  // MFD_CLOEXEC: the memory is handed to other processes explicitly (pass_fds, SCM_RIGHTS), never by accident.
  int fd = static_cast<int>(syscall(SYS_memfd_create, memfd_name, 1u /* MFD_CLOEXEC */));
  if (fd >= 0) {
    fchmod(fd, 0600);
    return fd;
  }
#endif
  tried = shm_prefix + std::to_string(getpid()) + "-" + std::to_string(monotonic_ns());
  int fd2 = shm_open(tried.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd2 >= 0) shm_unlink(tried.c_str());
  return fd2;
}

}  // namespace inprocess
