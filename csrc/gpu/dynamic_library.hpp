#pragma once

// Run-time loading of the GPU libraries (design principle 6). A library the
// process already loaded (torch loads libcuda and libnccl) is always the one
// used: opening it again by RTLD_NOLOAD takes a reference to that copy and
// never maps a second one.

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace inprocess::gpu {

// The path of the first loaded object whose file name starts with `prefix`
// (e.g. "libnccl.so"), from the dynamic linker's list (dl_iterate_phdr).
std::optional<std::string> find_loaded_object(const std::string& prefix);

class DynamicLibrary {
 public:
  // `path` opened with RTLD_NOLOAD first (an already loaded copy), else
  // loaded. Throws std::runtime_error with dlerror()'s text.
  static std::shared_ptr<DynamicLibrary> open(const std::string& path);
  // Only an already loaded copy; nullptr when `path` is not loaded.
  static std::shared_ptr<DynamicLibrary> open_loaded(const std::string& path);

  DynamicLibrary(const DynamicLibrary&) = delete;
  DynamicLibrary& operator=(const DynamicLibrary&) = delete;
  ~DynamicLibrary();

  // The symbol's address, nullptr when absent. dlsym on the handle: the
  // library itself first, then the libraries it needs, in load order.
  void* symbol(const char* name) const;
  // The file of the loaded object that holds `address` (dladdr), "" if none.
  static std::string file_of(const void* address);
  // The file the handle maps (from dlinfo), else the name it was opened by.
  const std::string& path() const { return path_; }
  bool was_loaded_before() const { return was_loaded_before_; }

 private:
  DynamicLibrary(void* handle, std::string path, bool was_loaded_before);
  void* handle_;
  std::string path_;
  bool was_loaded_before_;
};

// Lets a macro declare a variable of a function-pointer type written as one
// token list: `As<int (*)(char)> f;` where `int (*)(char) f;` is no syntax.
template <class T>
using As = T;

// Resolves a list of symbols into typed pointers; collects the names missing.
class SymbolTable {
 public:
  explicit SymbolTable(const DynamicLibrary& library) : library_(library) {}
  template <class Fn>
  void resolve(const char* name, Fn& out, bool required) {
    out = reinterpret_cast<Fn>(library_.symbol(name));
    if (out == nullptr && required) missing_.emplace_back(name);
  }
  // Throws std::runtime_error naming every missing required symbol.
  void throw_if_missing(const std::string& what) const;

 private:
  const DynamicLibrary& library_;
  std::vector<std::string> missing_;
};

}  // namespace inprocess::gpu
