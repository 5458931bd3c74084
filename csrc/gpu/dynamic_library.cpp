#include "gpu/dynamic_library.hpp"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <stdexcept>

namespace inprocess::gpu {

namespace {

struct FindContext {
  const std::string* prefix;
  std::optional<std::string> found;
};

int visit_object(dl_phdr_info* info, size_t, void* data) {
  auto* ctx = static_cast<FindContext*>(data);
  if (info->dlpi_name == nullptr || info->dlpi_name[0] == '\0') return 0;
  const char* slash = std::strrchr(info->dlpi_name, '/');
  const char* base = slash == nullptr ? info->dlpi_name : slash + 1;
  if (std::strncmp(base, ctx->prefix->c_str(), ctx->prefix->size()) != 0) return 0;
  ctx->found = info->dlpi_name;
  return 1;  // stop at the first
}

std::string mapped_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return map->l_name;
  }
  return fallback;
}

}  // namespace

std::optional<std::string> find_loaded_object(const std::string& prefix) {
  FindContext ctx{&prefix, std::nullopt};
  dl_iterate_phdr(&visit_object, &ctx);
  return ctx.found;
}

DynamicLibrary::DynamicLibrary(void* handle, std::string path, bool was_loaded_before)
    : handle_(handle), path_(std::move(path)), was_loaded_before_(was_loaded_before) {}

DynamicLibrary::~DynamicLibrary() {
  // Never dlclose: a thread abandoned at a deadline may still be inside the
  // library, and torch keeps its own reference anyway.
}

std::shared_ptr<DynamicLibrary> DynamicLibrary::open_loaded(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (handle == nullptr) return nullptr;
  return std::shared_ptr<DynamicLibrary>(new DynamicLibrary(handle, mapped_path(handle, path), true));
}

std::shared_ptr<DynamicLibrary> DynamicLibrary::open(const std::string& path) {
  if (auto loaded = open_loaded(path)) return loaded;
  dlerror();
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    throw std::runtime_error("cannot load " + path + ": " + (error != nullptr ? error : "unknown dlopen error"));
  }
  return std::shared_ptr<DynamicLibrary>(new DynamicLibrary(handle, mapped_path(handle, path), false));
}

void* DynamicLibrary::symbol(const char* name) const { return dlsym(handle_, name); }

std::string DynamicLibrary::file_of(const void* address) {
  Dl_info info{};
  if (address == nullptr || dladdr(address, &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

void SymbolTable::throw_if_missing(const std::string& what) const {
  if (missing_.empty()) return;
  std::string names;
  for (const auto& n : missing_) names += (names.empty() ? "" : ", ") + n;
  throw std::runtime_error(what + " (" + library_.path() + ") lacks " + names);
}

}  // namespace inprocess::gpu
