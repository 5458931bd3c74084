#include "numeric_host_names.hpp"

#include <elf.h>
#include <link.h>
#include <netdb.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>

namespace inprocess {
namespace {

using GetNameInfo = int (*)(const struct sockaddr*, socklen_t, char*, socklen_t, char*, socklen_t, int);

int numeric_getnameinfo(const struct sockaddr* addr, socklen_t addrlen, char* host, socklen_t hostlen, char* serv,
                        socklen_t servlen, int flags) {
  // This module's own reference binds to libc: it is never redirected.
  return ::getnameinfo(addr, addrlen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST);
}

#if defined(__x86_64__)
constexpr uint32_t kJumpSlot = R_X86_64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_X86_64_GLOB_DAT;
constexpr uint32_t kAbsolute = R_X86_64_64;
#elif defined(__aarch64__)
constexpr uint32_t kJumpSlot = R_AARCH64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_AARCH64_GLOB_DAT;
constexpr uint32_t kAbsolute = R_AARCH64_ABS64;
#else
#error "numeric_host_names: relocation types are known for x86_64 and aarch64 only"
#endif

struct Slot {
  std::string library;
  uintptr_t* address;
  uintptr_t original;
  bool read_only;  // its whole page lies in the object's RELRO segment: read-only once loaded
};

std::mutex g_mutex;
std::vector<Slot> g_slots;  // every slot redirected, in order

struct Search {
  const std::vector<std::string>* prefixes;
  std::vector<Slot> found;             // their getnameinfo slots
};

bool wanted(const char* path, const std::vector<std::string>& prefixes) {
  if (path == nullptr || *path == '\0') return false;
  const char* slash = std::strrchr(path, '/');
  std::string name = slash != nullptr ? slash + 1 : path;
  for (const auto& prefix : prefixes) {
    if (name.compare(0, prefix.size(), prefix) == 0) return true;
  }
  return false;
}

// ld.so relocates the d_ptr entries of .dynamic in place on x86_64 and
// aarch64; where it does not, they are offsets from the load address.
uintptr_t pointer(uintptr_t value, uintptr_t base) { return value < base ? value + base : value; }

struct Relro {
  uintptr_t begin = 0, end = 0;
};

void scan_relocations(const ElfW(Rela) * relocations, size_t bytes, const ElfW(Sym) * symbols, const char* names,
                      uintptr_t base, Relro relro, const char* library, std::vector<Slot>& found) {
  const uintptr_t page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  for (size_t i = 0; i < bytes / sizeof(ElfW(Rela)); ++i) {
    const ElfW(Rela)& r = relocations[i];
    const uint32_t type = ELF64_R_TYPE(r.r_info);
    if (type != kJumpSlot && type != kGlobDat && type != kAbsolute) continue;
    const uint32_t index = ELF64_R_SYM(r.r_info);
    if (index == 0 || std::strcmp(names + symbols[index].st_name, "getnameinfo") != 0) continue;
    const uintptr_t address = base + r.r_offset;
    const uintptr_t page = address & ~(page_size - 1);
    found.push_back(Slot{library, reinterpret_cast<uintptr_t*>(address), 0,
                         page >= relro.begin && page + page_size <= relro.end});
  }
}

int visit(struct dl_phdr_info* info, size_t, void* data) {
  auto* search = static_cast<Search*>(data);
  if (!wanted(info->dlpi_name, *search->prefixes)) return 0;
  const uintptr_t base = info->dlpi_addr;
  const ElfW(Dyn)* dynamic = nullptr;
  Relro relro;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_DYNAMIC) dynamic = reinterpret_cast<const ElfW(Dyn)*>(base + ph.p_vaddr);
    if (ph.p_type == PT_GNU_RELRO) relro = Relro{base + ph.p_vaddr, base + ph.p_vaddr + ph.p_memsz};
  }
  if (dynamic == nullptr) return 0;
  const ElfW(Sym)* symbols = nullptr;
  const char* names = nullptr;
  const ElfW(Rela)* plt = nullptr;
  const ElfW(Rela)* rela = nullptr;
  size_t plt_bytes = 0, rela_bytes = 0;
  bool plt_is_rela = true;
  for (const ElfW(Dyn)* d = dynamic; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {
      case DT_SYMTAB: symbols = reinterpret_cast<const ElfW(Sym)*>(pointer(d->d_un.d_ptr, base)); break;
      case DT_STRTAB: names = reinterpret_cast<const char*>(pointer(d->d_un.d_ptr, base)); break;
      case DT_JMPREL: plt = reinterpret_cast<const ElfW(Rela)*>(pointer(d->d_un.d_ptr, base)); break;
      case DT_PLTRELSZ: plt_bytes = d->d_un.d_val; break;
      case DT_PLTREL: plt_is_rela = d->d_un.d_val == DT_RELA; break;
      case DT_RELA: rela = reinterpret_cast<const ElfW(Rela)*>(pointer(d->d_un.d_ptr, base)); break;
      case DT_RELASZ: rela_bytes = d->d_un.d_val; break;
      default: break;
    }
  }
  if (symbols == nullptr || names == nullptr) return 0;
  const char* library = info->dlpi_name;
  if (plt != nullptr && plt_is_rela) scan_relocations(plt, plt_bytes, symbols, names, base, relro, library, search->found);
  if (rela != nullptr) scan_relocations(rela, rela_bytes, symbols, names, base, relro, library, search->found);
  return 0;
}

// Writes `value` into `slot`. The page is opened for the write (a store to a
// read-only page would fault) and closed again if it is read-only for good (a
// RELRO page); a page that ld.so left writable (the lazily bound GOT) stays so.
void write_slot(const Slot& slot, uintptr_t value) {
  const uintptr_t page_size = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  void* page = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(slot.address) & ~(page_size - 1));
  if (mprotect(page, page_size, PROT_READ | PROT_WRITE) != 0) {
    throw std::runtime_error("numeric_host_names: cannot make the getnameinfo slot of " + slot.library +
                             " writable: " + std::strerror(errno));
  }
  __atomic_store_n(slot.address, value, __ATOMIC_SEQ_CST);
  if (slot.read_only) mprotect(page, page_size, PROT_READ);
}

}  // namespace

std::vector<std::string> force_numeric_host_names(const std::vector<std::string>& prefixes) {
  std::lock_guard<std::mutex> lock(g_mutex);
  Search search{&prefixes, {}};
  dl_iterate_phdr(visit, &search);
  const auto wrapper = reinterpret_cast<uintptr_t>(&numeric_getnameinfo);
  std::vector<std::string> numeric;
  for (Slot& slot : search.found) {
    const uintptr_t current = __atomic_load_n(slot.address, __ATOMIC_SEQ_CST);
    if (current != wrapper) {
      slot.original = current;
      write_slot(slot, wrapper);
      g_slots.push_back(slot);
    }
    if (numeric.empty() || numeric.back() != slot.library) numeric.push_back(slot.library);
  }
  return numeric;
}

std::size_t restore_host_names() {
  std::lock_guard<std::mutex> lock(g_mutex);
  std::size_t restored = 0;
  for (auto it = g_slots.rbegin(); it != g_slots.rend(); ++it) {
    write_slot(*it, it->original);
    ++restored;
  }
  g_slots.clear();
  return restored;
}

}  // namespace inprocess
