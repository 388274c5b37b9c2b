# llama.cpp's test-profile build (scripts/install_llamacpp.sh: -DCMAKE_UNITY_BUILD=ON and
# -DCMAKE_PROJECT_INCLUDE=<this file>, which cmake includes right after every project() call): a unity build, except
# where sources cannot share a translation unit. ggml's CPU sources define the same static helpers in several files
# (ggml-cpu/repack.cpp and ggml-cpu/arch/x86/repack.cpp: nearest_int); tools/mtmd's helper library refuses to be
# compiled beside mtmd's internal headers (mtmd-helper.cpp: #error). Both build file by file, as released.
if(PROJECT_NAME STREQUAL "ggml")
    set(CMAKE_UNITY_BUILD OFF)
elseif(CMAKE_CURRENT_SOURCE_DIR STREQUAL CMAKE_SOURCE_DIR)
    function(eagle_lib_mtmd_file_by_file)
        get_property(targets DIRECTORY "${CMAKE_SOURCE_DIR}/tools/mtmd" PROPERTY BUILDSYSTEM_TARGETS)
        foreach(t IN LISTS targets)
            set_property(TARGET "${t}" PROPERTY UNITY_BUILD OFF)
        endforeach()
    endfunction()
    # at the end of the top-level CMakeLists, when tools/mtmd's targets exist
    cmake_language(DEFER DIRECTORY "${CMAKE_SOURCE_DIR}" CALL eagle_lib_mtmd_file_by_file)
endif()
