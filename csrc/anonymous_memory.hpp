#pragma once

#include <string>

namespace inprocess {

// A descriptor of fresh anonymous shared memory, mode 0600, close-on-exec: a
// memfd named `memfd_name` (it has no name in /dev/shm, so no exit path can
// leave it behind), or on kernels without memfd a POSIX segment named
// `shm_prefix` + pid + time, unlinked at once. Returns -1 with errno set when
// both fail; `tried` then holds the segment name, for the caller's message.
int create_anonymous_fd(const char* memfd_name, const std::string& shm_prefix, std::string& tried);

}  // namespace inprocess
