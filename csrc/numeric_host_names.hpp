#pragma once

// getnameinfo() that never asks a resolver, for the libraries that call it
// for log lines only (torch's TCPStore: every connection it opens or accepts
// is named by a reverse lookup of the peer's address, on the thread that
// serves or opens it; a resolver that drops the query stalls that thread for
// its timeout, the whole store server with it).
//
// The libraries' own calls are redirected, through their global offset table,
// to a wrapper that adds NI_NUMERICHOST: the answer is the address in numbers,
// at once. Nothing else in the process changes (other libraries, Python's
// socket module and libc itself still resolve).

#include <string>
#include <vector>

namespace inprocess {

// Redirects getnameinfo in every loaded object whose file name (without its
// directory) starts with one of `prefixes`. Idempotent. Returns the paths of
// the objects whose getnameinfo is now numeric (patched by this call or an
// earlier one). Throws std::runtime_error if a slot cannot be made writable.
std::vector<std::string> force_numeric_host_names(const std::vector<std::string>& prefixes);

// Puts every redirected slot back as it was; returns how many. For tests.
std::size_t restore_host_names();

}  // namespace inprocess
