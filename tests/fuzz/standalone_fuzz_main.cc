// A main for the fuzz targets when they are not built with libFuzzer (any
// compiler): runs LLVMFuzzerTestOneInput once on every file named on the
// command line or found (recursively) in a directory named there, so the
// checked-in corpora are replayed by every build. Arguments starting with
// '-' (libFuzzer flags) are ignored. Exits 1 when an input cannot be read
// or none was found; a failing input aborts inside the target.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool RunFile(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return false;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(file)),
                                std::istreambuf_iterator<char>());
  std::fprintf(stderr, "running %s (%zu bytes)\n", path.c_str(), bytes.size());
  // A copy of exactly the input's size, so reads past it are caught.
  std::vector<uint8_t> input(bytes.begin(), bytes.end());
  LLVMFuzzerTestOneInput(input.data(), input.size());
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int runs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.starts_with("-")) continue;
    std::vector<std::filesystem::path> paths;
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry :
           std::filesystem::recursive_directory_iterator(arg)) {
        if (entry.is_regular_file()) paths.push_back(entry.path());
      }
    } else {
      paths.push_back(arg);
    }
    for (const auto& path : paths) {
      if (!RunFile(path)) return 1;
      ++runs;
    }
  }
  std::fprintf(stderr, "%d inputs ran\n", runs);
  return runs > 0 ? 0 : 1;
}
