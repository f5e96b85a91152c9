# Included by CMake right after llama.cpp's own project() call in llama-cpp-python's
# build (CMAKE_PROJECT_llama.cpp_INCLUDE, which localrt.bootstrap.lean_cmake_args sets
# for localrt's own build and every variant localrt compiles).
#
# llama-cpp-python forces LLAMA_BUILD_COMMON on, so every build compiles llama.cpp's
# common library (argument parsing, chat parsers, downloads) and the cpp-httplib it
# needs: about a third of the compile. Nothing loads them: llama-cpp-python binds
# libllama, libggml* and libmtmd only, and mtmd must not link the common library. Turned
# off here, llama.cpp neither builds nor installs them; the libraries the wheel ships
# are the same.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp's common library: not loaded by llama-cpp-python" FORCE)
